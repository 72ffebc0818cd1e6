# e2b_sdk/ is E2B-only code run by test_e2b.py in a pytest of its own, under each e2b release's
# own Python environment (it imports nothing of DSec's): not part of this collection.
collect_ignore = ["e2b_sdk"]
