# Image for the multi-node demo (docker-compose.yml): one container per worker.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY transport transport
COPY zmqautograd zmqautograd
COPY tools tools
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir .
CMD ["python", "tools/demo.py"]
