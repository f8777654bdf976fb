"""``python -m services.frontend`` (also ``epd frontend``)."""

from services.frontend.service import FrontendService
from services.frontend.settings import FrontendSettings
from shared.service import service_main

if __name__ == "__main__":
    service_main(FrontendService, FrontendSettings)
