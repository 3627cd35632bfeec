"""pdserve: prefill/decode-disaggregated LLM serving over NATS JetStream."""

__version__ = "0.1.0"
