"""``python -m services.encoder`` (also ``epd encoder``)."""

from services.encoder.service import EncoderService
from services.encoder.settings import EncoderSettings
from shared.service import service_main

if __name__ == "__main__":
    service_main(EncoderService, EncoderSettings)
