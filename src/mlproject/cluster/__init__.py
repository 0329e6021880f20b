"""Running on a cluster: the sbatch script (slurm.py), the Kubeflow TrainJob (kubernetes.py) and preemption-safe
requeue (requeue.py)."""
