"""The command layer: the `actionopd` dispatcher (main.py) and the commands that choose what a
run is made of (train.py: the group source and its checks, the main job). Nothing in the
package imports this layer."""
