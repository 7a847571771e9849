"""artrl: train LLM agents from experience."""
