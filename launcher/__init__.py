"""The ``epd`` command: launching a stack on one machine (``epd up``), credentials, submitting requests."""
