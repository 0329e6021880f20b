"""Running on a cluster: the sbatch script (slurm.py), the Kubeflow TrainJob (kubernetes.py), the job size both
check (allocation.py) and preemption-safe requeue (requeue.py)."""
