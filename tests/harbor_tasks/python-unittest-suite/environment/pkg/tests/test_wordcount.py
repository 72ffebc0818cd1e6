import unittest

from wordcount import count


class T(unittest.TestCase):
    def test_count(self):
        self.assertEqual(count('a b  c'), 3)
