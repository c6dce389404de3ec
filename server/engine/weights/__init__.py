"""ChatTTS's weight files: which, where the server looks for them, fetching and checking them.

Nothing here imports torch or ChatTTS's code, so ``chattts-stream weights`` runs (and answers
quickly) on a machine that only fetches the files for another one.
"""
