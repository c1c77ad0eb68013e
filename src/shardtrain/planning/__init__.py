"""Dry-run planning: which module becomes a unit, what each unit holds, what memory it needs."""
