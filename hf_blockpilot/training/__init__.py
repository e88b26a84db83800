"""Training recipes: DFlash drafter training (target-regenerated data, cached target hidden states)."""
