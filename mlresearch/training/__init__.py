"""Training utilities: LR schedules (with restarts after growth), the growth trigger."""
