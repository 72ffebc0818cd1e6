# six() and seven() come from a.py and b.py, which the build puts before this file.
print(f'built: 3 modules, answer {six() * seven()}')  # noqa: F821
