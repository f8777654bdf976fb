"""``python -m services.prefill`` (also ``epd prefill``)."""

from services.prefill.service import PrefillService
from services.prefill.settings import PrefillSettings
from shared.service import service_main

if __name__ == "__main__":
    service_main(PrefillService, PrefillSettings)
