"""The toolkit-independent core of the model layer (DESIGN 2): :class:`~finetune.models.core.encoder.DualEncoder`
(``encoder``), :class:`~finetune.models.core.tokens.TokenizedText` and truncation (``tokens``), sentence spans
(``spans``). Nothing here imports a backend or a family."""
