"""The node agent: registers the node, holds its lease, runs its pods as runc containers.

    config      what the agent was started with (server, names, state directory, timings)
    identity    the node id and token it persists in its state directory
    backoff     retry pacing for a server that is down or restarting
    connection  registration, the lease (fencing token) and every write to the server
    hardware    discovery (NVML / simulated / CPU-only) and the CDI devices of its GPUs
    logship     incremental upload of a container's log by byte offset
    podworker   one pod attempt's life: pull, start or adopt, watch, stop, report, clean
    plan        the pure reconcile step: assignments + workers + containers -> actions
    agent       the process: threads for the lease and the assignments long-poll
"""
