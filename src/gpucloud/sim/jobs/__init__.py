"""Job-trace simulation: jobs with arrival times, durations and GPU counts, replayed on
the scheduler library under a queueing policy (``gpucloud sim jobs``)."""
