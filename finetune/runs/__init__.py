"""Run folders (DESIGN 6): what ``output.dir`` may hold and become, who writes into it, whether the disk can take a
run, and which checkpoint a resume continues from. Import each name from its module:

- :mod:`~finetune.runs.errors`: :class:`RunFolderError` (the base of the others), :class:`RunFolderBusy`,
  :class:`CheckpointError`;
- :mod:`~finetune.runs.identity`: which run a folder holds (``recipe.yaml``) and when two recipes are the same run;
- :mod:`~finetune.runs.space`: the bytes a run writes and the checks that the folder can take them;
- :mod:`~finetune.runs.lock`: one process writes into a run folder at a time (:class:`RunLock`);
- :mod:`~finetune.runs.checkpoints`: the reading side of checkpoints (the one listing, manifests, integrity);
- :mod:`~finetune.runs.resume`: the checkpoint ``train.resume`` names, checked, and the same run continued;
- :mod:`~finetune.runs.folder`: whether a run may write into ``output.dir``, clearing an old run and stale temporary
  files, and the ``--out`` of an evaluation.

The layer sits above :mod:`finetune.config` and below everything that runs a model; writing checkpoints is
:mod:`finetune.training.checkpoint`.
"""
