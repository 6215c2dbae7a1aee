"""Domain types shared by every part of gpucloud; imports nothing else of the project."""
