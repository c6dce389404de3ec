"""One-off studies: each answered one question (``bench/studies/README.md`` says which, and when).

Not suites: nothing imports a study but another study.
"""
