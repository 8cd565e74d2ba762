"""dsv41: an inference runtime for DeepSeek-V4.1-Flash-architecture models."""
