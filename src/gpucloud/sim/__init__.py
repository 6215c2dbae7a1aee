"""Trace-driven simulator of the scheduler: replays the FGD paper's protocol on the Alibaba
GPU trace, using exactly the scheduler library the control plane uses."""
