from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0013_node_layer_cap"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="under_review",
            field=models.BooleanField(default=False),
        ),
    ]
