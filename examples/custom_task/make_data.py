"""Writes ratings.csv: users rate items 1-5 by a planted taste (user factor x item factor, plus
the user's age), with noise and a few wild ratings. ``python make_data.py ROWS OUT.csv``"""

import sys

import numpy as np

rows, out = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)
users, items = 500, 200
u, v = rng.normal(size=(users, 4)), rng.normal(size=(items, 4))
age = rng.integers(18, 70, size=users)
user, item = rng.integers(0, users, rows), rng.zipf(1.3, rows) % items
taste = (u[user] * v[item]).sum(1) / 2 + (age[user] - 44) / 30
rating = np.clip(np.round(3 + taste + rng.normal(0, 0.5, rows)), 1, 5)
wild = rng.random(rows) < 0.02
rating[wild] = rng.integers(1, 6, wild.sum())
with open(out, "w") as f:
    f.write("rating,age,user,item\n")
    for row in zip(rating, age[user], user, item):
        f.write("%d,%d,u%d,i%d\n" % row)
