"""Everything NATS: subjects, the embedded server, streams, consumers and the registry."""
