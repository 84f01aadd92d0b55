from hybridkv.bench.tables import markdown_table


def test_markdown_table_pads_every_column_to_its_widest_cell():
    assert markdown_table(["layout", "hit"], [["sliding", "87.3%"], ["all full", 0.5]]).splitlines() == [
        "| layout   | hit   |",
        "|----------|-------|",
        "| sliding  | 87.3% |",
        "| all full | 0.5   |",
    ]
