"""Running on a cluster: the sbatch script (slurm.py) and preemption-safe requeue (requeue.py)."""
