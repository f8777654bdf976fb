"""``python -m services.language`` (also ``epd language``)."""

from services.language.service import LanguageService
from services.language.settings import LanguageSettings
from shared.service import service_main

if __name__ == "__main__":
    service_main(LanguageService, LanguageSettings)
