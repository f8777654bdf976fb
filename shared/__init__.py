"""What the epd services share: settings, logging, messages, the NATS bus, the data plane, models, the engine."""

__version__ = "0.1.0"
