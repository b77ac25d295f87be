"""The corpus job (`st-fastbackend embed-corpus`): read.py reads and checks the input, ids.py its ids, job.py runs
it on this machine, output.py writes and trusts the output folder's shards and manifest, guard.py locks the folder
and checks its room, identity.py says what the rows depend on, reuse.py copies the rows of texts already
embedded (in the run, or in an earlier output: --reuse), on_ray.py runs the same job on Ray Data."""


class CorpusError(Exception):
    """A mistake in the corpus job's input or output folder the user can fix (the CLI prints it in one line)."""
