"""Stage worker processes: one per device, each running its share of the model's layers."""
