"""The batch job (`scripts/batch_infer.py`): its input (`reader`: a JSONL file as a Grain source,
shards and resume state), its files beside the records (`files`: outputs, rejects, settings),
and the job's logic between them (`job`: what one process generates, resuming from its
checkpoint, refusing a rerun that cannot continue the files, merging the parts of a multi-process
run). The script keeps its flags, messages and exit codes."""
