"""Writes tests/data/awm_mini/ and tests/data/envscaler_mini/: small datasets of our own in the
AWM and EnvScaler published layouts (docs/formats.md). Run from the repo root after editing;
the written files are committed, so tests never run this.

    python tests/data/make_mini_pools.py
"""

from __future__ import annotations

import json
from pathlib import Path
from textwrap import dedent

from awm_published_scenario import bike_rental  # run as a script: its directory is on sys.path

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------- AWM ----------------------

SERVER_HEAD = '''\
import os
import sqlite3

try:
    from mcp.server.mcpserver import MCPServer as _Server
except ImportError:
    from mcp.server.fastmcp import FastMCP as _Server

DATABASE_URL = os.environ.get("DATABASE_PATH") or "sqlite:///{name}.db"
DB_FILE = DATABASE_URL[len("sqlite:///"):] if DATABASE_URL.startswith("sqlite:///") else DATABASE_URL
USER_ID = 1
mcp = _Server("{name}")


def _rows(sql, params=()):
    con = sqlite3.connect(DB_FILE)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute(sql, params)]
    finally:
        con.close()


def _write(sql, params=()):
    con = sqlite3.connect(DB_FILE)
    try:
        cur = con.execute(sql, params)
        con.commit()
        return {{"id": cur.lastrowid, "changed": cur.rowcount}}
    finally:
        con.close()
'''

SERVER_TAIL = '''

if __name__ == "__main__":
    host = os.getenv("HOST", "127.0.0.1")
    port = int(os.getenv("PORT", "8000"))
    if os.getenv("MCP_TRANSPORT", "streamable-http") == "stdio":
        mcp.run("stdio")
    else:
        try:
            mcp.run("streamable-http", host=host, port=port)
        except TypeError:
            mcp.settings.host, mcp.settings.port = host, port
            mcp.run("streamable-http")
'''


def endpoint(op, method, path, summary, params, tables):
    return {"path": path, "method": method, "summary": summary, "description": summary + ".",
            "operation_id": op, "tags": [tables[0]],
            "request_params": {p: {"type": t, "param_type": "query" if method == "GET" else "body",
                                   "required": req, "description": d, "example": ex}
                               for p, (t, req, d, ex) in params.items()},
            "response": {"result": {"type": "object", "description": "what the operation returns"}},
            "required_tables": tables, "required_fields": {}}


SCENARIOS = []

# 1. a lending library ----------------------------------------------------------------------
SCENARIOS.append(dict(
    name="library_loans_1",
    description="A small public library: members search the catalogue, borrow books and return them.",
    tables=[
        ("members", "CREATE TABLE members (id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT UNIQUE NOT NULL);", []),
        ("books", "CREATE TABLE books (id INTEGER PRIMARY KEY, title TEXT NOT NULL, author TEXT NOT NULL, copies_available INTEGER NOT NULL CHECK (copies_available >= 0));",
         ["CREATE INDEX idx_books_title ON books(title);"]),
        ("loans", "CREATE TABLE loans (id INTEGER PRIMARY KEY, member_id INTEGER NOT NULL REFERENCES members(id), book_id INTEGER NOT NULL REFERENCES books(id), returned INTEGER NOT NULL DEFAULT 0);", []),
    ],
    rows={
        "members": ["INSERT INTO members (id, name, email) VALUES (1, 'Ada Park', 'ada@example.org');",
                    "INSERT INTO members (id, name, email) VALUES (2, 'Ben Ortiz', 'ben@example.org');"],
        "books": ["INSERT INTO books (id, title, author, copies_available) VALUES (1, 'The Quiet River', 'M. Stone', 2);",
                  "INSERT INTO books (id, title, author, copies_available) VALUES (2, 'Salt and Stars', 'R. Vance', 1);",
                  "INSERT INTO books (id, title, author, copies_available) VALUES (3, 'Maps of Nowhere', 'L. Ito', 0);",
                  "INSERT INTO books (id, title, author, copies_available) VALUES (4, 'Garden Physics', 'M. Stone', 3);"],
        "loans": ["INSERT INTO loans (id, member_id, book_id, returned) VALUES (1, 1, 3, 0);",
                  "INSERT INTO loans (id, member_id, book_id, returned) VALUES (2, 2, 1, 1);"],
    },
    endpoints=[
        endpoint("search_books", "GET", "/api/books", "Search the catalogue by a word of the title",
                 {"title_query": ("string", True, "part of the title", "River")}, ["books"]),
        endpoint("borrow_book", "POST", "/api/loans", "Borrow one copy of a book for the current member",
                 {"book_id": ("integer", True, "id of the book", 1)}, ["loans", "books"]),
        endpoint("return_book", "POST", "/api/loans/return", "Return a borrowed book by its loan id",
                 {"loan_id": ("integer", True, "id of the loan", 1)}, ["loans", "books"]),
        endpoint("list_my_loans", "GET", "/api/loans", "List the current member's loans that are not returned",
                 {}, ["loans"]),
    ],
    tools='''

@mcp.tool(name="search_books", description="Search the catalogue by a word of the title.")
def search_books(title_query: str) -> list:
    return _rows("SELECT id, title, author, copies_available FROM books WHERE title LIKE ? ORDER BY id",
                 ("%" + title_query + "%",))


@mcp.tool(name="borrow_book", description="Borrow one copy of a book for the current member.")
def borrow_book(book_id: int) -> dict:
    book = _rows("SELECT copies_available FROM books WHERE id = ?", (book_id,))
    if not book:
        return {"error": "no such book"}
    if book[0]["copies_available"] < 1:
        return {"error": "no copy available"}
    _write("UPDATE books SET copies_available = copies_available - 1 WHERE id = ?", (book_id,))
    return _write("INSERT INTO loans (member_id, book_id, returned) VALUES (?, ?, 0)", (USER_ID, book_id))


@mcp.tool(name="return_book", description="Return a borrowed book by its loan id.")
def return_book(loan_id: int) -> dict:
    loan = _rows("SELECT book_id, returned FROM loans WHERE id = ? AND member_id = ?", (loan_id, USER_ID))
    if not loan or loan[0]["returned"]:
        return {"error": "no open loan with that id"}
    _write("UPDATE loans SET returned = 1 WHERE id = ?", (loan_id,))
    return _write("UPDATE books SET copies_available = copies_available + 1 WHERE id = ?", (loan[0]["book_id"],))


@mcp.tool(name="list_my_loans", description="List the current member's loans that are not returned.")
def list_my_loans() -> list:
    return _rows("SELECT loans.id AS loan_id, books.title FROM loans JOIN books ON books.id = loans.book_id "
                 "WHERE loans.member_id = ? AND loans.returned = 0", (USER_ID,))
''',
    tasks=[
        ("Borrow a copy of 'Salt and Stars'.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import sqlite3
    before = sqlite3.connect(initial_db_path)
    after = sqlite3.connect(final_db_path)
    n0 = before.execute("SELECT COUNT(*) FROM loans WHERE member_id = 1 AND book_id = 2 AND returned = 0").fetchone()[0]
    n1 = after.execute("SELECT COUNT(*) FROM loans WHERE member_id = 1 AND book_id = 2 AND returned = 0").fetchone()[0]
    copies = after.execute("SELECT copies_available FROM books WHERE id = 2").fetchone()[0]
    before.close(); after.close()
    return {"result": "complete" if n1 == n0 + 1 and copies == 0 else "others"}
'''),
        ("Return the book 'Maps of Nowhere' that I have on loan.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import sqlite3
    after = sqlite3.connect(final_db_path)
    returned = after.execute("SELECT returned FROM loans WHERE id = 1").fetchone()[0]
    copies = after.execute("SELECT copies_available FROM books WHERE id = 3").fetchone()[0]
    after.close()
    return {"result": "complete" if returned == 1 and copies == 1 else "others"}
'''),
        ("Borrow one copy of every book by M. Stone that has a copy available.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import sqlite3
    after = sqlite3.connect(final_db_path)
    got = {r[0] for r in after.execute("SELECT book_id FROM loans WHERE member_id = 1 AND returned = 0")}
    after.close()
    return {"result": "complete" if {1, 4} <= got else "others"}
'''),
        ("How many copies of 'Garden Physics' can I borrow right now? Tell me the number.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import re
    import sqlite3
    con = sqlite3.connect(final_db_path)
    copies = con.execute("SELECT copies_available FROM books WHERE id = 4").fetchone()[0]
    con.close()
    numbers = re.findall(r"\\d+", final_answer or "")
    return {"result": "complete" if str(copies) in numbers else "others"}
'''),
    ],
    sql_verifiers={0: '''
def verify_task(initial_db_path, final_db_path):
    import sqlite3
    out = {}
    for label, path in (("initial", initial_db_path), ("final", final_db_path)):
        con = sqlite3.connect(path)
        out[label + "_open_loans_of_book_2"] = con.execute(
            "SELECT COUNT(*) FROM loans WHERE member_id = 1 AND book_id = 2 AND returned = 0").fetchone()[0]
        out[label + "_copies_of_book_2"] = con.execute("SELECT copies_available FROM books WHERE id = 2").fetchone()[0]
        con.close()
    return out
'''},
))

# 2. a recipe box ---------------------------------------------------------------------------
SCENARIOS.append(dict(
    name="recipe_box_2",
    description="A personal recipe collection: browse recipes by cuisine, keep favourites and add new recipes.",
    tables=[
        ("recipes", "CREATE TABLE recipes (id INTEGER PRIMARY KEY, title TEXT NOT NULL, cuisine TEXT NOT NULL, minutes INTEGER NOT NULL, owner_id INTEGER);",
         ["CREATE INDEX idx_recipes_cuisine ON recipes(cuisine);"]),
        ("favorites", "CREATE TABLE favorites (user_id INTEGER NOT NULL, recipe_id INTEGER NOT NULL REFERENCES recipes(id), PRIMARY KEY (user_id, recipe_id));", []),
    ],
    rows={
        "recipes": ["INSERT INTO recipes (id, title, cuisine, minutes, owner_id) VALUES (1, 'Lemon Lentil Soup', 'mediterranean', 40, NULL);",
                    "INSERT INTO recipes (id, title, cuisine, minutes, owner_id) VALUES (2, 'Miso Glazed Aubergine', 'japanese', 30, NULL);",
                    "INSERT INTO recipes (id, title, cuisine, minutes, owner_id) VALUES (3, 'Quick Tomato Pasta', 'italian', 15, NULL);",
                    "INSERT INTO recipes (id, title, cuisine, minutes, owner_id) VALUES (4, 'Slow Ragu', 'italian', 180, NULL);"],
        "favorites": ["INSERT INTO favorites (user_id, recipe_id) VALUES (1, 4);"],
    },
    endpoints=[
        endpoint("list_recipes", "GET", "/api/recipes", "List recipes of one cuisine",
                 {"cuisine": ("string", True, "cuisine name in lower case", "italian")}, ["recipes"]),
        endpoint("add_favorite", "POST", "/api/favorites", "Mark a recipe as a favourite of the current user",
                 {"recipe_id": ("integer", True, "id of the recipe", 1)}, ["favorites"]),
        endpoint("remove_favorite", "DELETE", "/api/favorites", "Remove a recipe from the current user's favourites",
                 {"recipe_id": ("integer", True, "id of the recipe", 1)}, ["favorites"]),
        endpoint("create_recipe", "POST", "/api/recipes", "Add a new recipe owned by the current user",
                 {"title": ("string", True, "recipe title", "Pea Risotto"),
                  "cuisine": ("string", True, "cuisine name in lower case", "italian"),
                  "minutes": ("integer", True, "preparation time in minutes", 35)}, ["recipes"]),
    ],
    tools='''

@mcp.tool(name="list_recipes", description="List recipes of one cuisine.")
def list_recipes(cuisine: str) -> list:
    return _rows("SELECT id, title, minutes FROM recipes WHERE cuisine = ? ORDER BY id", (cuisine.lower(),))


@mcp.tool(name="add_favorite", description="Mark a recipe as a favourite of the current user.")
def add_favorite(recipe_id: int) -> dict:
    if not _rows("SELECT id FROM recipes WHERE id = ?", (recipe_id,)):
        return {"error": "no such recipe"}
    return _write("INSERT OR IGNORE INTO favorites (user_id, recipe_id) VALUES (?, ?)", (USER_ID, recipe_id))


@mcp.tool(name="remove_favorite", description="Remove a recipe from the current user's favourites.")
def remove_favorite(recipe_id: int) -> dict:
    return _write("DELETE FROM favorites WHERE user_id = ? AND recipe_id = ?", (USER_ID, recipe_id))


@mcp.tool(name="create_recipe", description="Add a new recipe owned by the current user.")
def create_recipe(title: str, cuisine: str, minutes: int) -> dict:
    return _write("INSERT INTO recipes (title, cuisine, minutes, owner_id) VALUES (?, ?, ?, ?)",
                  (title, cuisine.lower(), minutes, USER_ID))
''',
    tasks=[
        ("Add 'Quick Tomato Pasta' to my favourites.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import sqlite3
    con = sqlite3.connect(final_db_path)
    ok = con.execute("SELECT COUNT(*) FROM favorites WHERE user_id = 1 AND recipe_id = 3").fetchone()[0] == 1
    con.close()
    return {"result": "complete" if ok else "others"}
'''),
        ("Remove 'Slow Ragu' from my favourites.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import sqlite3
    con = sqlite3.connect(final_db_path)
    left = con.execute("SELECT COUNT(*) FROM favorites WHERE user_id = 1 AND recipe_id = 4").fetchone()[0]
    con.close()
    return {"result": "complete" if left == 0 else "others"}
'''),
        ("Save a new italian recipe called 'Pea Risotto' that takes 35 minutes.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import sqlite3
    con = sqlite3.connect(final_db_path)
    rows = con.execute("SELECT cuisine, minutes, owner_id FROM recipes WHERE title = 'Pea Risotto'").fetchall()
    con.close()
    return {"result": "complete" if rows == [("italian", 35, 1)] else "others"}
'''),
        ("Favourite the quickest japanese recipe.", "sql", '''
def verify_task(initial_db_path, final_db_path):
    import sqlite3
    con = sqlite3.connect(final_db_path)
    fav = [r[0] for r in con.execute(
        "SELECT recipes.title FROM favorites JOIN recipes ON recipes.id = favorites.recipe_id WHERE favorites.user_id = 1")]
    quickest = con.execute("SELECT title FROM recipes WHERE cuisine = 'japanese' ORDER BY minutes LIMIT 1").fetchone()[0]
    con.close()
    return {"favourite_titles": fav, "quickest_japanese_recipe": quickest}
'''),
    ],
    sql_verifiers={},
))

# 3. gym classes ----------------------------------------------------------------------------
SCENARIOS.append(dict(
    name="gym_classes_3",
    description="A neighbourhood gym's class timetable: see the week's classes, book places and cancel bookings.",
    tables=[
        ("classes", "CREATE TABLE classes (id INTEGER PRIMARY KEY, name TEXT NOT NULL, day TEXT NOT NULL, start_time TEXT NOT NULL, places_left INTEGER NOT NULL);",
         ["CREATE INDEX idx_classes_day ON classes(day);"]),
        ("bookings", "CREATE TABLE bookings (id INTEGER PRIMARY KEY, user_id INTEGER NOT NULL, class_id INTEGER NOT NULL REFERENCES classes(id), status TEXT NOT NULL DEFAULT 'booked');", []),
    ],
    rows={
        "classes": ["INSERT INTO classes (id, name, day, start_time, places_left) VALUES (1, 'Spin', 'monday', '07:00', 4);",
                    "INSERT INTO classes (id, name, day, start_time, places_left) VALUES (2, 'Yoga', 'monday', '18:30', 0);",
                    "INSERT INTO classes (id, name, day, start_time, places_left) VALUES (3, 'Yoga', 'wednesday', '18:30', 6);",
                    "INSERT INTO classes (id, name, day, start_time, places_left) VALUES (4, 'Boxing', 'friday', '19:00', 2);"],
        "bookings": ["INSERT INTO bookings (id, user_id, class_id, status) VALUES (1, 1, 4, 'booked');"],
    },
    endpoints=[
        endpoint("list_classes", "GET", "/api/classes", "List the classes held on a day of the week",
                 {"day": ("string", True, "day of the week in lower case", "monday")}, ["classes"]),
        endpoint("book_class", "POST", "/api/bookings", "Book a place in a class for the current user",
                 {"class_id": ("integer", True, "id of the class", 1)}, ["bookings", "classes"]),
        endpoint("cancel_booking", "POST", "/api/bookings/cancel", "Cancel one of the current user's bookings",
                 {"booking_id": ("integer", True, "id of the booking", 1)}, ["bookings", "classes"]),
        endpoint("list_my_bookings", "GET", "/api/bookings", "List the current user's active bookings", {}, ["bookings"]),
    ],
    tools='''

@mcp.tool(name="list_classes", description="List the classes held on a day of the week.")
def list_classes(day: str) -> list:
    return _rows("SELECT id, name, start_time, places_left FROM classes WHERE day = ? ORDER BY start_time",
                 (day.lower(),))


@mcp.tool(name="book_class", description="Book a place in a class for the current user.")
def book_class(class_id: int) -> dict:
    found = _rows("SELECT places_left FROM classes WHERE id = ?", (class_id,))
    if not found:
        return {"error": "no such class"}
    if found[0]["places_left"] < 1:
        return {"error": "the class is full"}
    _write("UPDATE classes SET places_left = places_left - 1 WHERE id = ?", (class_id,))
    return _write("INSERT INTO bookings (user_id, class_id, status) VALUES (?, ?, 'booked')", (USER_ID, class_id))


@mcp.tool(name="cancel_booking", description="Cancel one of the current user's bookings.")
def cancel_booking(booking_id: int) -> dict:
    found = _rows("SELECT class_id FROM bookings WHERE id = ? AND user_id = ? AND status = 'booked'",
                  (booking_id, USER_ID))
    if not found:
        return {"error": "no active booking with that id"}
    _write("UPDATE bookings SET status = 'cancelled' WHERE id = ?", (booking_id,))
    return _write("UPDATE classes SET places_left = places_left + 1 WHERE id = ?", (found[0]["class_id"],))


@mcp.tool(name="list_my_bookings", description="List the current user's active bookings.")
def list_my_bookings() -> list:
    return _rows("SELECT bookings.id AS booking_id, classes.name, classes.day FROM bookings "
                 "JOIN classes ON classes.id = bookings.class_id WHERE bookings.user_id = ? AND status = 'booked'",
                 (USER_ID,))
''',
    tasks=[
        ("Book me a place in Monday's Spin class.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import sqlite3
    con = sqlite3.connect(final_db_path)
    n = con.execute("SELECT COUNT(*) FROM bookings WHERE user_id = 1 AND class_id = 1 AND status = 'booked'").fetchone()[0]
    left = con.execute("SELECT places_left FROM classes WHERE id = 1").fetchone()[0]
    con.close()
    return {"result": "complete" if n == 1 and left == 3 else "others"}
'''),
        ("Cancel my Friday Boxing booking.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import sqlite3
    con = sqlite3.connect(final_db_path)
    status = con.execute("SELECT status FROM bookings WHERE id = 1").fetchone()[0]
    con.close()
    return {"result": "complete" if status == "cancelled" else "others"}
'''),
        ("Monday's Yoga is full, so book the Wednesday Yoga class instead.", "code", '''
def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
    import sqlite3
    con = sqlite3.connect(final_db_path)
    got = {r[0] for r in con.execute("SELECT class_id FROM bookings WHERE user_id = 1 AND status = 'booked'")}
    con.close()
    return {"result": "complete" if 3 in got and 2 not in got else "others"}
'''),
        ("What time does the Boxing class start on Friday?", "sql", '''
def verify_task(initial_db_path, final_db_path):
    import sqlite3
    con = sqlite3.connect(final_db_path)
    start = con.execute("SELECT start_time FROM classes WHERE id = 4").fetchone()[0]
    changed = con.execute("SELECT COUNT(*) FROM bookings").fetchone()[0]
    con.close()
    return {"boxing_start_time": start, "bookings_rows": changed, "read_only_task": True}
'''),
    ],
    sql_verifiers={},
))


# 4. bike rental, in the published FastAPI form (awm_published_scenario.py)
SCENARIOS.append(bike_rental(endpoint))

def call(tool, **arguments):
    return {"tool": tool, "arguments": arguments}


def say(text):
    return {"message": text}


# Ours, not part of AWM's layout: one reference solution per task (the tool calls in order, then
# the final answer), written to reference_solutions.jsonl for the privileged reference teacher
# (envs/reference.py) alone; docs/formats.md says so.
SOLUTIONS = {
    "library_loans_1": [
        [call("search_books", title_query="Salt and Stars"), call("borrow_book", book_id=2),
         say("I borrowed 'Salt and Stars' for you.")],
        [call("list_my_loans"), call("return_book", loan_id=1), say("'Maps of Nowhere' is returned.")],
        [call("search_books", title_query=""), call("borrow_book", book_id=1), call("borrow_book", book_id=4),
         say("I borrowed 'The Quiet River' and 'Garden Physics', the M. Stone books with a copy available.")],
        [call("search_books", title_query="Garden Physics"), say("You can borrow 3 copies of 'Garden Physics' now.")],
    ],
    "recipe_box_2": [
        [call("list_recipes", cuisine="italian"), call("add_favorite", recipe_id=3),
         say("'Quick Tomato Pasta' is in your favourites.")],
        [call("remove_favorite", recipe_id=4), say("'Slow Ragu' is no longer a favourite.")],
        [call("create_recipe", title="Pea Risotto", cuisine="italian", minutes=35), say("I saved 'Pea Risotto'.")],
        [call("list_recipes", cuisine="japanese"), call("add_favorite", recipe_id=2),
         say("'Miso Glazed Aubergine' (30 minutes) is now a favourite.")],
    ],
    "gym_classes_3": [
        [call("list_classes", day="monday"), call("book_class", class_id=1), say("You are booked into Monday's Spin.")],
        [call("list_my_bookings"), call("cancel_booking", booking_id=1), say("Your Friday Boxing booking is cancelled.")],
        [call("list_classes", day="wednesday"), call("book_class", class_id=3),
         say("You are booked into Wednesday's Yoga at 18:30.")],
        [call("list_classes", day="friday"), say("The Friday Boxing class starts at 19:00.")],
    ],
    "bike_rental_4": [
        [call("list_stations", min_bikes=1), call("rent_bike", station_id=1), say("You have a bike from Harbour Dock.")],
        [call("list_my_rentals"), call("return_bike", rental_id=1, station_id=2), say("Your bike is returned at Park Lane.")],
        [call("list_stations"), say("Old Mill has the most free bikes (5).")],
    ],
}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def make_awm(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "gen_scenario.jsonl", [{"name": s["name"], "description": s["description"]} for s in SCENARIOS])
    write_jsonl(out / "gen_tasks.jsonl", [{"scenario": s["name"], "tasks": [t[0] for t in s["tasks"]]} for s in SCENARIOS])
    write_jsonl(out / "gen_db.jsonl", [
        {"scenario": s["name"], "db_path": f"outputs/databases/{s['name']}.db",
         "db_schema": {"tables": [{"name": n, "ddl": ddl, "indexes": idx} for n, ddl, idx in s["tables"]]}}
        for s in SCENARIOS])
    write_jsonl(out / "gen_sample.jsonl", [
        {"scenario": s["name"], "tables_count": len(s["rows"]),
         "inserts_count": sum(len(v) for v in s["rows"].values()),
         "sample_data": {"tables": [{"table_name": n, "insert_statements": v} for n, v in s["rows"].items()]}}
        for s in SCENARIOS])
    write_jsonl(out / "gen_spec.jsonl", [
        {"scenario": s["name"], "api_spec": {"api_groups": [{"group_name": s["name"], "endpoints": s["endpoints"]}]}}
        for s in SCENARIOS])
    write_jsonl(out / "gen_envs.jsonl", [
        {"scenario": s["name"], "db_path": f"outputs/databases/{s['name']}.db",
         "full_code": s.get("full_code") or SERVER_HEAD.format(name=s["name"]) + s["tools"] + SERVER_TAIL}
        for s in SCENARIOS])
    code_rows, sql_rows = [], []
    for s in SCENARIOS:
        for i, (task, mode, code) in enumerate(s["tasks"]):
            code = dedent(code).strip() + "\n"
            if mode == "code":
                raw = {"reasoning": "compare the final database with the task's expected change",
                       "python_code": code, "function_name": "verify_task_completion"}
                code_rows.append({"scenario": s["name"], "task_idx": i, "task": task,
                                  "verification": {"code": code, "raw_response": json.dumps(raw)}})
            sql = code if mode == "sql" else s["sql_verifiers"].get(i)
            if sql:
                sql = dedent(sql).strip() + "\n"
                raw = {"reasoning": "collects the rows the task is about, before and after",
                       "python_code": sql, "function_name": "verify_task",
                       "success_criteria": "the returned values show the state the task asks for",
                       "failure_criteria": "the returned values show the state unchanged or changed otherwise"}
                sql_rows.append({"scenario": s["name"], "task_idx": i, "task": task,
                                 "verification": {"code": sql, "raw_response": json.dumps(raw)}})
    write_jsonl(out / "gen_verifier.pure_code.jsonl", code_rows)
    write_jsonl(out / "gen_verifier.jsonl", sql_rows)
    write_jsonl(out / "reference_solutions.jsonl", [
        {"scenario": s["name"], "task_idx": i, "actions": actions}
        for s in SCENARIOS for i, actions in enumerate(SOLUTIONS[s["name"]])])


# ---------------------------------------------------------------- EnvScaler ----------------

LOCKER_CODE = '''\
from typing import Dict, TypedDict


class LockerInfo(TypedDict):
    locker_id: str
    site: str
    occupied_by: str


class ParcelInfo(TypedDict):
    parcel_id: str
    recipient: str
    status: str
    locker_id: str


class ParcelLockerSystem:
    def __init__(self, init_config: dict):
        self.lockers: Dict[str, LockerInfo] = {}
        self.parcels: Dict[str, ParcelInfo] = {}

    def list_parcels(self, recipient: str) -> dict:
        """List the parcels addressed to a recipient.

        Args:
            recipient (str): the recipient's full name.
        """
        found = [p for p in self.parcels.values() if p["recipient"] == recipient]
        return {"success": True, "data": found}

    def list_free_lockers(self, site: str) -> dict:
        """List the empty lockers at a site.

        Args:
            site (str): the site name.
        """
        free = [l["locker_id"] for l in self.lockers.values() if l["site"] == site and not l["occupied_by"]]
        return {"success": True, "data": free}

    def assign_parcel(self, parcel_id: str, locker_id: str) -> dict:
        """Put a waiting parcel into an empty locker.

        Args:
            parcel_id (str): the parcel.
            locker_id (str): the empty locker.
        """
        parcel = self.parcels.get(parcel_id)
        locker = self.lockers.get(locker_id)
        if parcel is None or locker is None:
            return {"success": False, "error": "unknown parcel or locker"}
        if locker["occupied_by"]:
            return {"success": False, "error": "locker is occupied"}
        if parcel["status"] != "waiting":
            return {"success": False, "error": "parcel is not waiting"}
        locker["occupied_by"] = parcel_id
        parcel["status"] = "in_locker"
        parcel["locker_id"] = locker_id
        return {"success": True, "message": f"{parcel_id} is in {locker_id}"}

    def mark_collected(self, parcel_id: str) -> dict:
        """Record that the recipient took a parcel out of its locker.

        Args:
            parcel_id (str): the parcel.
        """
        parcel = self.parcels.get(parcel_id)
        if parcel is None or parcel["status"] != "in_locker":
            return {"success": False, "error": "parcel is not in a locker"}
        self.lockers[parcel["locker_id"]]["occupied_by"] = ""
        parcel["status"] = "collected"
        return {"success": True, "message": f"{parcel_id} collected"}
'''

CLINIC_CODE = '''\
from typing import Dict, TypedDict


class SlotInfo(TypedDict):
    slot_id: str
    doctor: str
    time: str
    free: bool


class AppointmentInfo(TypedDict):
    appointment_id: str
    slot_id: str
    patient: str
    status: str


class ClinicAppointments:
    def __init__(self, init_config: dict):
        self.slots: Dict[str, SlotInfo] = {}
        self.appointments: Dict[str, AppointmentInfo] = {}
        self.next_number: int = 1

    def find_slots(self, doctor: str) -> dict:
        """List a doctor's free slots.

        Args:
            doctor (str): the doctor's name, e.g. "Dr. Hale".
        """
        return {"success": True, "data": [s for s in self.slots.values() if s["doctor"] == doctor and s["free"]]}

    def book_slot(self, slot_id: str, patient: str) -> dict:
        """Book a free slot for a patient.

        Args:
            slot_id (str): the slot.
            patient (str): the patient's full name.
        """
        slot = self.slots.get(slot_id)
        if slot is None or not slot["free"]:
            return {"success": False, "error": "slot is not free"}
        appointment_id = f"A{self.next_number}"
        self.next_number += 1
        slot["free"] = False
        self.appointments[appointment_id] = {"appointment_id": appointment_id, "slot_id": slot_id,
                                             "patient": patient, "status": "booked"}
        return {"success": True, "message": f"booked {appointment_id}"}

    def cancel_appointment(self, appointment_id: str) -> dict:
        """Cancel a booked appointment and free its slot.

        Args:
            appointment_id (str): the appointment.
        """
        appt = self.appointments.get(appointment_id)
        if appt is None or appt["status"] != "booked":
            return {"success": False, "error": "no booked appointment with that id"}
        appt["status"] = "cancelled"
        self.slots[appt["slot_id"]]["free"] = True
        return {"success": True, "message": f"cancelled {appointment_id}"}

    def list_appointments(self, patient: str) -> dict:
        """List a patient's appointments.

        Args:
            patient (str): the patient's full name.
        """
        return {"success": True, "data": [a for a in self.appointments.values() if a["patient"] == patient]}
'''


def tool(name, description, params):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": t, "description": d} for p, (t, d) in params.items()},
                       "required": list(params)}}}


ENVS = {
    "env_1": {
        "env_id": "env_1",
        "environment_summary": "parcel locker network",
        "environment_introduction": "A network of parcel lockers: parcels wait at a depot, are put into free lockers and are collected by their recipients.",
        "state_space_definition": [
            {"entity": "Locker", "attributes": "locker_id, site, occupied_by", "description": "one locker at a site"},
            {"entity": "Parcel", "attributes": "parcel_id, recipient, status, locker_id", "description": "a parcel and where it is"}],
        "constraints_rules": ["A locker holds at most one parcel.", "Only a waiting parcel can be put into a locker.",
                              "Only a parcel in a locker can be collected."],
        "operation_list": [{"operation_name": n, "operation_type": k, "description": d} for n, k, d in (
            ("list_parcels", "query", "parcels of a recipient"), ("list_free_lockers", "query", "empty lockers at a site"),
            ("assign_parcel", "modify", "put a parcel into a locker"), ("mark_collected", "modify", "record a collection"))],
        "env_class_name": "ParcelLockerSystem",
        "env_class_code": LOCKER_CODE,
        "env_class_def": LOCKER_CODE.split("    def list_parcels")[0],
        "env_structure": {"states": {"lockers": {"type": "Dict[str, LockerInfo]"}, "parcels": {"type": "Dict[str, ParcelInfo]"}},
                          "methods": {}},
        "tools": [
            tool("list_parcels", "List the parcels addressed to a recipient.", {"recipient": ("string", "the recipient's full name")}),
            tool("list_free_lockers", "List the empty lockers at a site.", {"site": ("string", "the site name")}),
            tool("assign_parcel", "Put a waiting parcel into an empty locker.",
                 {"parcel_id": ("string", "the parcel"), "locker_id": ("string", "the empty locker")}),
            tool("mark_collected", "Record that the recipient took a parcel out of its locker.", {"parcel_id": ("string", "the parcel")}),
        ],
    },
    "env_2": {
        "env_id": "env_2",
        "environment_summary": "clinic appointment book",
        "environment_introduction": "A small clinic's appointment book: doctors offer time slots that patients book and cancel.",
        "state_space_definition": [
            {"entity": "Slot", "attributes": "slot_id, doctor, time, free", "description": "a bookable time of a doctor"},
            {"entity": "Appointment", "attributes": "appointment_id, slot_id, patient, status", "description": "a booking"}],
        "constraints_rules": ["A slot can be booked once.", "Cancelling an appointment frees its slot."],
        "operation_list": [{"operation_name": n, "operation_type": k, "description": d} for n, k, d in (
            ("find_slots", "query", "free slots of a doctor"), ("book_slot", "modify", "book a slot"),
            ("cancel_appointment", "modify", "cancel a booking"), ("list_appointments", "query", "a patient's bookings"))],
        "env_class_name": "ClinicAppointments",
        "env_class_code": CLINIC_CODE,
        "env_class_def": CLINIC_CODE.split("    def find_slots")[0],
        "env_structure": {"states": {"slots": {"type": "Dict[str, SlotInfo]"}, "appointments": {"type": "Dict[str, AppointmentInfo]"}},
                          "methods": {}},
        "tools": [
            tool("find_slots", "List a doctor's free slots.", {"doctor": ("string", "the doctor's name, e.g. \"Dr. Hale\"")}),
            tool("book_slot", "Book a free slot for a patient.", {"slot_id": ("string", "the slot"), "patient": ("string", "the patient's full name")}),
            tool("cancel_appointment", "Cancel a booked appointment and free its slot.", {"appointment_id": ("string", "the appointment")}),
            tool("list_appointments", "List a patient's appointments.", {"patient": ("string", "the patient's full name")}),
        ],
    },
}

LOCKERS = {"lockers": {"L1": {"locker_id": "L1", "site": "Harbour St", "occupied_by": ""},
                       "L2": {"locker_id": "L2", "site": "Harbour St", "occupied_by": "P9"},
                       "L3": {"locker_id": "L3", "site": "Mill Road", "occupied_by": ""}},
           "parcels": {"P7": {"parcel_id": "P7", "recipient": "Nora Quist", "status": "waiting", "locker_id": ""},
                       "P8": {"parcel_id": "P8", "recipient": "Nora Quist", "status": "waiting", "locker_id": ""},
                       "P9": {"parcel_id": "P9", "recipient": "Omar Said", "status": "in_locker", "locker_id": "L2"}}}
CLINIC = {"slots": {"S1": {"slot_id": "S1", "doctor": "Dr. Hale", "time": "09:00", "free": True},
                    "S2": {"slot_id": "S2", "doctor": "Dr. Hale", "time": "10:00", "free": False},
                    "S3": {"slot_id": "S3", "doctor": "Dr. Imai", "time": "11:30", "free": True}},
          "appointments": {"A0": {"appointment_id": "A0", "slot_id": "S2", "patient": "Lena Roth", "status": "booked"}},
          "next_number": 1}


def check(item, body):
    return {"check_item": item, "check_func": "def check_func(final_state):\n" + dedent(body).strip("\n").replace("\n", "\n    ").join(["    ", ""]) + "\n"}


SCENARIO_TASKS = [
    dict(env_id="env_1", env_class_name="ParcelLockerSystem", task_id="mini_locker_1", init_config=LOCKERS,
         reference=[("list_free_lockers", {'site': 'Harbour St'}), ("assign_parcel", {'parcel_id': 'P7', 'locker_id': 'L1'})],
         task="Put parcel P7 into a free locker at Harbour St.",
         checks=[("Is P7 in locker L1?", 'return final_state["parcels"]["P7"]["status"] == "in_locker" and final_state["lockers"]["L1"]["occupied_by"] == "P7"')]),
    dict(env_id="env_1", env_class_name="ParcelLockerSystem", task_id="mini_locker_2", init_config=LOCKERS,
         reference=[("list_parcels", {'recipient': 'Omar Said'}), ("mark_collected", {'parcel_id': 'P9'})],
         task="Omar Said has taken his parcel out of its locker; record the collection.",
         checks=[("Is P9 collected?", 'return final_state["parcels"]["P9"]["status"] == "collected"'),
                 ("Is L2 empty again?", 'return final_state["lockers"]["L2"]["occupied_by"] == ""')]),
    dict(env_id="env_1", env_class_name="ParcelLockerSystem", task_id="mini_locker_3", init_config=LOCKERS,
         reference=[("list_parcels", {'recipient': 'Nora Quist'}), ("assign_parcel", {'parcel_id': 'P7', 'locker_id': 'L1'}), ("assign_parcel", {'parcel_id': 'P8', 'locker_id': 'L3'})],
         task="Put both of Nora Quist's waiting parcels into lockers: one at Harbour St and one at Mill Road.",
         checks=[("Are both of Nora's parcels in lockers?",
                  'return all(final_state["parcels"][p]["status"] == "in_locker" for p in ("P7", "P8"))'),
                 ("Is nothing else changed?", 'return final_state["parcels"]["P9"] == initial_state["parcels"]["P9"]')]),
    dict(env_id="env_2", env_class_name="ClinicAppointments", task_id="mini_clinic_1", init_config=CLINIC,
         reference=[("find_slots", {'doctor': 'Dr. Imai'}), ("book_slot", {'slot_id': 'S3', 'patient': 'Tom Berg'})],
         task="Book Dr. Imai's free slot for Tom Berg.",
         checks=[("Does Tom Berg have a booked appointment in S3?",
                  'return any(a["slot_id"] == "S3" and a["patient"] == "Tom Berg" and a["status"] == "booked" for a in final_state["appointments"].values())')]),
    dict(env_id="env_2", env_class_name="ClinicAppointments", task_id="mini_clinic_2", init_config=CLINIC,
         reference=[("list_appointments", {'patient': 'Lena Roth'}), ("cancel_appointment", {'appointment_id': 'A0'})],
         task="Cancel Lena Roth's appointment.",
         checks=[("Is A0 cancelled?", 'return final_state["appointments"]["A0"]["status"] == "cancelled"'),
                 ("Is S2 free again?", 'return final_state["slots"]["S2"]["free"] is True')]),
    dict(env_id="env_2", env_class_name="ClinicAppointments", task_id="mini_clinic_3", init_config=CLINIC,
         reference=[("book_slot", {'slot_id': 'S1', 'patient': 'Lena Roth'}), ("cancel_appointment", {'appointment_id': 'A0'})],
         task="You are Lena Roth. You want to move your appointment with Dr. Hale to his 09:00 slot: first ask the assistant to book 09:00 with Dr. Hale for you, and only then to cancel the old appointment.",
         conversational=True,
         checks=[("Does Lena have a booked appointment in S1?",
                  'return any(a["slot_id"] == "S1" and a["patient"] == "Lena Roth" and a["status"] == "booked" for a in final_state["appointments"].values())'),
                 ("Is the old appointment cancelled?", 'return final_state["appointments"]["A0"]["status"] == "cancelled"')]),
]


def make_envscaler(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "env_metadata.json").write_text(json.dumps(ENVS, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    items = []
    for t in SCENARIO_TASKS:
        item = {k: t[k] for k in ("env_id", "env_class_name", "task_id", "init_config", "task")}
        # our extension (docs/formats.md), written on every record: a published record has no
        # mode and loads as conversational (envs/envscaler/mode.py); ours are mostly one-turn
        item["conversational"] = bool(t.get("conversational"))
        item["checklist"] = [c[0] for c in t["checks"]]
        item["checklist_with_func"] = [check(c, body) for c, body in t["checks"]]
        # our extension: a solution for the privileged reference teacher (the format has none)
        item["reference_actions"] = [{"name": n, "arguments": a} for n, a in t["reference"]]
        items.append(item)
    (out / "rl_scenario_metadata.json").write_text(json.dumps(items, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    make_awm(HERE / "awm_mini")
    make_envscaler(HERE / "envscaler_mini")
    print("wrote", HERE / "awm_mini", "and", HERE / "envscaler_mini")
