"""The mini AWM pool's scenario in the PUBLISHED server form (a plain FastAPI app over
SQLAlchemy, no MCP code: AWM's gen_envs full_code), imported by make_mini_pools.py."""


# 4. bike rental, in the PUBLISHED form: a plain FastAPI app over SQLAlchemy, no MCP code of its
# own (AWM's gen_envs full_code); the runtime serves it over MCP / streamable HTTP
# (envs/awm/fastapi_host.py). `full_code` replaces the mini servers' SERVER_HEAD + tools + TAIL.
BIKE_CODE = """\
import os

import uvicorn
from fastapi import FastAPI, HTTPException, Query
from pydantic import BaseModel
from sqlalchemy import Column, ForeignKey, Integer, String, create_engine
from sqlalchemy.orm import declarative_base, sessionmaker

DATABASE_URL = os.getenv("DATABASE_PATH", "sqlite:///bike_rental_4.db")
engine = create_engine(DATABASE_URL, connect_args={"check_same_thread": False})
SessionLocal = sessionmaker(bind=engine)
Base = declarative_base()
USER_ID = 1


class Station(Base):
    __tablename__ = "stations"
    id = Column(Integer, primary_key=True)
    name = Column(String, nullable=False)
    bikes_available = Column(Integer, nullable=False)


class Rental(Base):
    __tablename__ = "rentals"
    id = Column(Integer, primary_key=True)
    rider_id = Column(Integer, nullable=False)
    station_id = Column(Integer, ForeignKey("stations.id"), nullable=False)
    end_station_id = Column(Integer, ForeignKey("stations.id"))
    active = Column(Integer, nullable=False, default=1)


# as published AWM servers do: the tables are created at import, so the server opens its
# database before it serves anything (a server that cannot reach DATABASE_PATH fails to start)
Base.metadata.create_all(bind=engine)


class RentRequest(BaseModel):
    station_id: int


class ReturnRequest(BaseModel):
    station_id: int


app = FastAPI(title="bike_rental_4")


@app.get("/api/stations", operation_id="list_stations", summary="List stations with their free bikes")
def list_stations(min_bikes: int = Query(0, description="only stations with at least this many free bikes")):
    with SessionLocal() as db:
        rows = db.query(Station).filter(Station.bikes_available >= min_bikes).order_by(Station.id).all()
        return [{"id": s.id, "name": s.name, "bikes_available": s.bikes_available} for s in rows]


@app.post("/api/rentals", operation_id="rent_bike", summary="Rent a bike at a station for the current rider")
def rent_bike(body: RentRequest):
    with SessionLocal() as db:
        station = db.get(Station, body.station_id)
        if station is None:
            raise HTTPException(status_code=404, detail="no such station")
        if station.bikes_available < 1:
            raise HTTPException(status_code=409, detail="no bike available at this station")
        station.bikes_available -= 1
        rental = Rental(rider_id=USER_ID, station_id=station.id, active=1)
        db.add(rental)
        db.commit()
        return {"rental_id": rental.id, "station_id": station.id}


@app.get("/api/rentals", operation_id="list_my_rentals", summary="List the current rider's active rentals")
def list_my_rentals():
    with SessionLocal() as db:
        rows = db.query(Rental).filter(Rental.rider_id == USER_ID, Rental.active == 1).order_by(Rental.id).all()
        return [{"rental_id": r.id, "from_station_id": r.station_id} for r in rows]


@app.post("/api/rentals/{rental_id}/return", operation_id="return_bike",
          summary="End an active rental by returning its bike at a station")
def return_bike(rental_id: int, body: ReturnRequest):
    with SessionLocal() as db:
        rental = db.get(Rental, rental_id)
        if rental is None or rental.rider_id != USER_ID or not rental.active:
            raise HTTPException(status_code=404, detail="no active rental with that id")
        station = db.get(Station, body.station_id)
        if station is None:
            raise HTTPException(status_code=404, detail="no such station")
        rental.active, rental.end_station_id = 0, station.id
        station.bikes_available += 1
        db.commit()
        return {"rental_id": rental.id, "returned_at": station.name}


if __name__ == "__main__":
    uvicorn.run(app, host=os.getenv("HOST", "127.0.0.1"), port=int(os.getenv("PORT", "8000")))
"""

def bike_rental(endpoint):
    """The scenario record (make_mini_pools.py's SCENARIOS shape); `endpoint` builds its spec rows."""
    return dict(
        name="bike_rental_4",
        description="A city bike-share: riders find stations with free bikes, rent one and return it at any station.",
        tables=[
            ("stations", "CREATE TABLE stations (id INTEGER PRIMARY KEY, name TEXT NOT NULL, bikes_available INTEGER NOT NULL CHECK (bikes_available >= 0));", []),
            ("rentals", "CREATE TABLE rentals (id INTEGER PRIMARY KEY, rider_id INTEGER NOT NULL, station_id INTEGER NOT NULL REFERENCES stations(id), end_station_id INTEGER REFERENCES stations(id), active INTEGER NOT NULL DEFAULT 1);", []),
        ],
        rows={
            "stations": ["INSERT INTO stations (id, name, bikes_available) VALUES (1, 'Harbour Dock', 2);",
                         "INSERT INTO stations (id, name, bikes_available) VALUES (2, 'Park Lane', 0);",
                         "INSERT INTO stations (id, name, bikes_available) VALUES (3, 'Old Mill', 5);"],
            "rentals": ["INSERT INTO rentals (id, rider_id, station_id, end_station_id, active) VALUES (1, 1, 3, NULL, 1);"],
        },
        endpoints=[
            endpoint("list_stations", "GET", "/api/stations", "List stations with their free bikes",
                     {"min_bikes": ("integer", False, "only stations with at least this many free bikes", 1)}, ["stations"]),
            endpoint("rent_bike", "POST", "/api/rentals", "Rent a bike at a station for the current rider",
                     {"station_id": ("integer", True, "id of the station", 1)}, ["rentals", "stations"]),
            endpoint("list_my_rentals", "GET", "/api/rentals", "List the current rider's active rentals", {}, ["rentals"]),
            endpoint("return_bike", "POST", "/api/rentals/{rental_id}/return",
                     "End an active rental by returning its bike at a station",
                     {"rental_id": ("integer", True, "id of the rental", 1),
                      "station_id": ("integer", True, "id of the station", 2)}, ["rentals", "stations"]),
        ],
        full_code=BIKE_CODE,
        tasks=[
            ("Rent a bike at Harbour Dock.", "code", """
    def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
        import sqlite3
        after = sqlite3.connect(final_db_path)
        rented = after.execute("SELECT COUNT(*) FROM rentals WHERE rider_id = 1 AND station_id = 1 AND active = 1").fetchone()[0]
        bikes = after.execute("SELECT bikes_available FROM stations WHERE id = 1").fetchone()[0]
        return {"result": "complete" if rented == 1 and bikes == 1 else "others"}
    """),
            ("Return the bike I am riding at Park Lane.", "code", """
    def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
        import sqlite3
        after = sqlite3.connect(final_db_path)
        active, end = after.execute("SELECT active, end_station_id FROM rentals WHERE id = 1").fetchone()
        bikes = after.execute("SELECT bikes_available FROM stations WHERE id = 2").fetchone()[0]
        return {"result": "complete" if active == 0 and end == 2 and bikes == 1 else "others"}
    """),
            ("Which station has the most free bikes right now? Do not rent one.", "code", """
    def verify_task_completion(initial_db_path, final_db_path, final_answer=None):
        import sqlite3
        before = sqlite3.connect(initial_db_path).execute("SELECT * FROM rentals ORDER BY id").fetchall()
        after = sqlite3.connect(final_db_path).execute("SELECT * FROM rentals ORDER BY id").fetchall()
        named = "old mill" in (final_answer or "").lower()
        return {"result": "complete" if before == after and named else "others"}
    """),
        ],
        sql_verifiers={},
    )
