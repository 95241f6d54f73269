"""The local process stack: start, watch and stop cohort's processes on one machine, with an
embedded Redis when none is given.

A floor of its own, below the entry points (`launch`) and the tools that spawn whole stacks
(`bench`, the e2e tests), so that neither imports the other; it imports no cohort package.
"""
