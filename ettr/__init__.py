"""ettr: attribute a training job's wall time across restarts and export its goodput (ETTR)."""
