from orbit_dagster.control.retention import plan


def ck(step, tier="durable", value=None, parent=None):
    return {"checkpoint_key": f"j/{step}", "step": step, "tier": tier, "value": value, "parent_key": parent}


def test_keeps_latest_best_and_fresh_emergencies():
    rows = [ck(10, value=3.0), ck(20, value=1.0), ck(30, value=2.5), ck(40, value=2.4), ck(45, "emergency", 2.3, "j/40"),
            ck(50, value=2.2), ck(60, value=2.1)]
    keep, delete = plan(rows, keep_latest=2, keep_best=1, mode="min")
    assert keep == {"j/50", "j/60", "j/20"}  # the emergency at 45 is superseded by the durable at 50
    assert delete == {"j/10", "j/30", "j/40", "j/45"}


def test_an_emergency_newer_than_every_durable_is_kept_with_its_delta_base():
    rows = [ck(10, value=3.0), ck(20, value=2.0), ck(30, value=1.9), ck(35, "emergency", 1.8, "j/30")]
    keep, delete = plan(rows, keep_latest=1, keep_best=0, mode="min")
    assert {"j/35", "j/30"} <= keep and delete == {"j/10", "j/20"}


def test_unranked_checkpoints_are_never_deleted_and_max_mode_ranks_upwards():
    rows = [ck(10, value=0.5), ck(20, value=0.9), ck(30), ck(40, value=0.1)]
    keep, delete = plan(rows, keep_latest=1, keep_best=1, mode="max")
    assert keep == {"j/40", "j/20", "j/30"} and delete == {"j/10"}
