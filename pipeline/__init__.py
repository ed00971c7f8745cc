"""The run's config and its data path, below every process role (docs/architecture.md). No Ray actors here."""
