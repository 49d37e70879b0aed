"""The backends that wrap a library's model as a :class:`~finetune.models.core.encoder.DualEncoder` (DESIGN 2):
transformers (``hf``), open_clip (``openclip``), the pooled-tower fast paths (``pooled_tower``) and fused
activations (``activations``)."""
