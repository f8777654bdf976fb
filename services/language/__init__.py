"""The language-model side: one worker every LM service is made of, and the joined (E/PD) service."""
