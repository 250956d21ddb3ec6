"""Models to plan, outside the library proper: the built-in zoo and the ``make demo`` script.

Nothing in the planning pipeline imports this package; the CLI, the demo,
the notebook, the tests and the benchmarks do, for ready-to-run training
steps by name (:mod:`memplan.models.zoo`)::

    from memplan.models import zoo
    zm = zoo.build("gpt2-small", meta=True)
"""
from memplan.models.zoo import ZooModel, aliases, build, names, sizes

__all__ = ["ZooModel", "aliases", "build", "names", "sizes"]
