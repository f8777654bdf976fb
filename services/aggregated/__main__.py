"""``python -m services.aggregated`` (also ``epd aggregated``)."""

from services.aggregated.service import AggregatedService
from services.aggregated.settings import AggregatedSettings
from shared.service import service_main

if __name__ == "__main__":
    service_main(AggregatedService, AggregatedSettings)
