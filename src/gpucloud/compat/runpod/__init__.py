"""RunPod-compatible GraphQL and REST APIs over gpucloud's services (docs/runpod.md)."""
