# The image docker-compose.yml runs: the package with every store's client, and the example.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir -e ".[redis,consul,rq]"
ENV PYTHONUNBUFFERED=1
