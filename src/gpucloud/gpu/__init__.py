"""GPU discovery for the node agent: NVML, simulated hardware profiles, and CDI devices.

``discovery.discover`` is the entry point; ``cdi`` turns assigned GPUs into edits of an OCI
runtime config.
"""
