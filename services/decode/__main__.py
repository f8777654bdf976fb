"""``python -m services.decode`` (also ``epd decode``)."""

from services.decode.service import DecodeService
from services.decode.settings import DecodeSettings
from shared.service import service_main

if __name__ == "__main__":
    service_main(DecodeService, DecodeSettings)
