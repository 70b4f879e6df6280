"""Every exercise's check under one name: ``from engine_lib.exercises import check``, then
``check.ex05_2(my_function)``. See ``engine_lib/exercises/__init__.py``."""

from .ch00 import ex00_1, ex00_2, ex00_3
from .ch01 import ex01_1, ex01_2, ex01_3
from .ch02 import ex02_1, ex02_2, ex02_3
from .ch03 import ex03_1, ex03_2, ex03_3
from .ch04 import ex04_1, ex04_2, ex04_3
from .ch05 import ex05_1, ex05_2, ex05_3
from .ch06 import ex06_1, ex06_2, ex06_3, ex06_4
from .ch07 import ex07_1, ex07_2, ex07_3, ex07_4
from .ch08 import ex08_1, ex08_2, ex08_3, ex08_4
from .ch09 import ex09_1, ex09_2, ex09_3, ex09_4
from .ch10 import ex10_1, ex10_2, ex10_3, ex10_4
from .ch11 import ex11_1, ex11_2, ex11_3, ex11_4
from .ch12 import ex12_1, ex12_2, ex12_3
from .ch13 import ex13_1, ex13_2
from .ch14 import ex14_1, ex14_2, ex14_3

__all__ = ["ex00_1", "ex00_2", "ex00_3", "ex01_1", "ex01_2", "ex01_3", "ex02_1", "ex02_2", "ex02_3", "ex03_1",
           "ex03_2", "ex03_3", "ex04_1", "ex04_2", "ex04_3", "ex05_1", "ex05_2", "ex05_3", "ex06_1", "ex06_2", "ex06_3", "ex06_4",
           "ex07_1", "ex07_2", "ex07_3", "ex07_4", "ex08_1", "ex08_2", "ex08_3", "ex08_4", "ex09_1", "ex09_2",
           "ex09_3", "ex09_4", "ex10_1", "ex10_2", "ex10_3", "ex10_4", "ex11_1", "ex11_2", "ex11_3", "ex11_4",
           "ex12_1", "ex12_2", "ex12_3",
           "ex13_1", "ex13_2", "ex14_1", "ex14_2", "ex14_3"]
