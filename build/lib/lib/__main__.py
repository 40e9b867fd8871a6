"""The compendium's command line: ``python -m lib <command>`` (``python -m lib --help`` lists the commands)."""
from lib.infra.runner import main

main()
