"""Speculative decoding: drafters propose a decoding sequence's next tokens cheaply (`drafters.py`), the target model
scores every drafted position in the same layer-major weight pass as the sequence's next token (the scheduler's
chunk carries the draft: scheduler/plan.py), and `acceptance.py` keeps the tokens the target agrees with."""
