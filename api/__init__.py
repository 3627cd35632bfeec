"""The HTTP front door: OpenAI- and SGLang-compatible endpoints over NATS."""
