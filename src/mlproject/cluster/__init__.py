"""Running on a cluster: signals and divergence agreed by all ranks, so that a stopped or preempted job saves and
resumes (requeue.py); and each scheduler's own module: the job it writes, the checks before submission and inside
the job."""
