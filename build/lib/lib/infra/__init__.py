"""Infrastructure, apart from the science: paths, the cache, seeds and progress bars (repro), the measurement
store, notebook parameters, the results ledgers, the notebooks' index, running and testing notebooks, Colab.

Nothing here imports the science (``lib``'s core modules or ``lib.papers``): the dependencies point one way,
from the papers to the core to this package.
"""
