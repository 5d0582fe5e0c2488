"""Chat datasets: readers and validation, chat-template rendering with loss masks, splits, demo data."""
