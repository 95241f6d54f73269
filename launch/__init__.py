"""The entry points: the `cohort` command, the local process stack and `cohort serve`.

This package sits above every other one (it starts them); nothing below imports it except the
tools that spawn whole stacks (the e2e tests and the live benchmark).
"""
