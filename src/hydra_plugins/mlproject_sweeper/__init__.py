"""mlproject's Hydra sweeper (study_sweeper.py). Hydra accepts plugins only from the hydra_plugins package,
and imports every module here at start-up: they import nothing heavy at module level."""
